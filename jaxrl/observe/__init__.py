"""What a run reports: metrics rows, sinks, curves, profiling."""
