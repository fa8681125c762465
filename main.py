"""Train torchvision models on ImageNet or any ImageFolder data set.

Same command line as pytorch/examples' imagenet/main.py; see README.md.
"""

import signal
import sys

# Threads that libraries start while they are imported (import torch starts one) inherit this
# mask, so a Ctrl-C always reaches the main thread; main() takes it back (see cli._spawn).
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})

from imagenet.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
