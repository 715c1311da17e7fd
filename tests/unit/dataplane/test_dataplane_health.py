"""A frontend says neither live nor ready until every port it serves is open, so a client
that polled one protocol's health never finds the other protocol's port closed."""
from services.dataplane.client import DataPlane
from services.frontend.settings import FrontendSettings


def test_not_live_nor_ready_while_the_ports_open():
    dp = DataPlane(FrontendSettings(scheduler_addr="", use_shm=False))  # no sockets opened
    dp._scheduler_ready = True        # what the scheduler's repository broadcast would say
    dp.starting = True
    assert (dp.live(), dp.ready()) == (False, False)
    dp.starting = False
    assert (dp.live(), dp.ready()) == (True, True)
    dp._scheduler_ready = False
    assert (dp.live(), dp.ready()) == (True, False)
