import sys

from trainmon.cli import main

sys.exit(main())
