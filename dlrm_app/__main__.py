import sys

from dlrm_app.cli import main

sys.exit(main())
