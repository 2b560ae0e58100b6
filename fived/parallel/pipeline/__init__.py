"""Pipeline parallelism: partition (stage.py), schedules as data (schedules.py), executor (runtime.py)."""
