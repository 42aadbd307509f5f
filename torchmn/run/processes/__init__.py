"""Starting, watching and ending the job's processes on this machine: the ranks (``supervisor.py``),
their output (``output.py``), process groups and ``prctl`` (``groups.py``), the guardian that ends
the job if the launcher dies (``guardian.py``), and the CPUs each rank is bound to (``binding.py``,
which the watcher on other hosts uses too)."""
