"""`import triton_python_backend_utils as pb_utils` outside a worker (tests, editors): the
same module object the worker gives a model.py (services/workers/pb_utils.py)."""
import sys

from services.workers.python import pb_utils

sys.modules[__name__] = pb_utils
