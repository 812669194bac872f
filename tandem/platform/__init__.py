"""What the process runs on: device and dtype resolution, the profiler hooks, and the
machine's description and measured ceilings."""
