"""Process services: checkpoints, the compilation cache, host memory."""
