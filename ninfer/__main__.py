import sys

from ninfer.cli import main

sys.exit(main())
