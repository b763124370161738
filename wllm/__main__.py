import sys

from wllm.cli import main

sys.exit(main())
