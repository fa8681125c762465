"""Train torchvision models on ImageNet or any ImageFolder data set.

Same command line as pytorch/examples' imagenet/main.py; see README.md.
"""

import sys

from imagenet.cli import main

if __name__ == "__main__":
    sys.exit(main())
