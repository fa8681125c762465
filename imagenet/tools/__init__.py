"""Side tools that are not part of a training run: ILSVRC2012 preparation, the environment
check, the demo data set generator. The trainer imports them lazily."""
