import sys

from services.analyze.main import main

sys.exit(main())
