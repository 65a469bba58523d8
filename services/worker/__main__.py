import sys

from services.worker.main import main

sys.exit(main())
