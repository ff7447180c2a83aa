import sys

from lightning_swarm.memory.cli import main

sys.exit(main())
