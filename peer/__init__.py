"""The training process: configuration, the node, modes, `phalanx.Optimizer`, the trainer loop,
checkpoints and the health it serves. The command line (phalanx.cli) and the tools (phalanx.tools)
import it; it imports neither."""
