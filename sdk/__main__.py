import sys

from hearthlm.cli import main

sys.exit(main())
