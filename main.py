"""Train torchvision models on ImageNet or any ImageFolder data set.

Same command line as pytorch/examples' imagenet/main.py; see README.md.
"""

import _signal  # the built-in C module: `import signal` first imports enum (~8 ms)

# Ctrl-C is held back while Python imports (see cli.hold_interrupts); threads that libraries
# start meanwhile (import torch starts one) inherit this mask, so it always reaches the main
# thread. main() takes it back once the imports are done. Blocked before any other import: a
# Ctrl-C during `import signal`'s own imports printed a KeyboardInterrupt traceback.
_signal.pthread_sigmask(_signal.SIG_BLOCK, {_signal.SIGINT})

from imagenet.cli import end_process, main  # noqa: E402

if __name__ == "__main__":
    end_process(main(own_process=True))
