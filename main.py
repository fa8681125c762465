"""Train torchvision models on ImageNet or any ImageFolder data set.

Same command line as pytorch/examples' imagenet/main.py; see README.md.
"""

import signal
import sys

# Ctrl-C is held back while Python imports (see cli.hold_interrupts); threads that libraries
# start meanwhile (import torch starts one) inherit this mask, so it always reaches the main
# thread. main() takes it back once the imports are done.
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})

from imagenet.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(own_process=True))
