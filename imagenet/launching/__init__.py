"""Launching: the processes find each other, stay together and stop together.

  process_group joins the process group the plan describes, with errors that say what to check;
                who this process is (``DistInfo``); one rank's error raised on every rank, rank
                0's value on every rank, a barrier; all of them without a group too.
  failures      one rank's failure stops every rank within seconds, with its message; after the
                run, a process stuck or stopped in its teardown is ended the same way.
  preemption    SIGTERM/SIGUSR1/SIGINT and a dead launcher: finish the step, agree, stop; what a
                process knows of the others (/proc, stacks on a signal, dying with its parent).
  timelimit     --time-limit: rank 0's clock asks for that stop in time to save.
  watchdog      --hang-timeout: a rank that makes no progress is named, its stacks written, ended.
"""
