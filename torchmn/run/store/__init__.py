"""The rendezvous store ``torchmn run`` hosts (``rendezvous.py``), and its gate, which admits the
job's processes alone: the job's token (``auth.py``), the gate (``gate.py``) with its byte pipes
(``pipes.py``), who holds a connection (``peers.py``), and another host's relay to it (``relay.py``)."""
