import sys

from megamlm.cli import main

sys.exit(main())
