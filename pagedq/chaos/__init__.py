"""The chaos soak behind `pagedq bench chaos` (pagedq/bench/chaos.py): the service as
child processes (cluster), a steady mixed load (load), faults (faults), what the clients
saw (ledger), and the invariants checked afterwards (checks)."""
