import sys

from treeserve.cli import main

sys.exit(main())
