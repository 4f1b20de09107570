"""`switchboard worker`: a process of its own that works one endpoint's queues over the REST API, exactly as a
third-party worker would, so it needs no database and runs on any machine that reaches the server. It imports only
the standard library, httpx, pydantic and its own modules: it starts fast and shares no code with the server.

  job           what a job is: the claimed todo, the runner's interface, the outcomes a runner returns
  park          quota parks shared by the workers of a quota group on one host
  api           the REST calls, and which answers are worth trying again
  exec_runner   `--exec -- CMD …`: a child process per todo
  triage        `--triage`: sizing issues with a model and labelling them
  loop          the slots: claim, lease, heartbeat, timeout, report, shutdown
  main          the command line: flags, token file, logging, the job kind
"""
