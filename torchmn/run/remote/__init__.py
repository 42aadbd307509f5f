"""Ranks on other hosts: ``-H`` and hostfiles (``hostfile.py``), ssh command lines and host checks
(``ssh.py``), and the watcher that runs each remote rank there (``watcher.py``, ``protocol.py``)."""
