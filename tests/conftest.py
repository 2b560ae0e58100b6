"""The suite's one pool of ranks: every multi-rank test forks its ranks from one server that
imported torch and fived once (``fived.ranks.launch.use_forkserver``), instead of spawning
interpreters that import them again (~0.2 s for 4 ranks against ~10 s spawned on 2 cores). A
test that needs new interpreters passes ``fresh=True`` to ``run_local`` or runs a subprocess."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

from fived.ranks.launch import use_forkserver  # noqa: E402 - after OMP_NUM_THREADS

# what a rank's function needs; a test module that imports transformers at its top is imported
# by every rank that runs one of its functions, so rank functions live elsewhere
PRELOAD = ("torch", "torch.distributed", "fived.testing", "fived.train.trainer",
           "fived.train.dryrun", "fived.checkpoint.state", "fived.infer.generate")

use_forkserver(PRELOAD)
