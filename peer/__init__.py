"""The running Phalanx process: CLI, configuration, trainer loop, tasks, checkpoints."""
