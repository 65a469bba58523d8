"""`python -m services.kvstore`: run the KV page store."""

import sys

from services.kvstore.main import main

sys.exit(main())
