import sys

from dlrm_app.launcher import main

sys.exit(main())
