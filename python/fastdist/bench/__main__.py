import sys

from fastdist.bench.cli import main

sys.exit(main())
