"""What the process runs on: device and dtype resolution, and the profiler hooks."""
