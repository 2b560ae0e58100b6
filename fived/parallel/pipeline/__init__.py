"""Pipeline parallelism: partition (stage.py) and executor (runtime.py); the schedules as data
are ``fived.schedules`` (torch-free: the ledger replays them too)."""
