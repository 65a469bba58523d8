"""`python -m services.scheduler`: run one scheduler replica."""

import sys

from services.scheduler.main import main

sys.exit(main())
