"""`python -m services.gateway`: run the HTTP gateway."""

import sys

from services.gateway.main import main

sys.exit(main())
