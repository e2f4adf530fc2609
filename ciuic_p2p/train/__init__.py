"""The trainer side: the training-loop hook (hook), its connection to the daemon
(channel), embedded mode (embedded), the dense baseline (ring), the tasks of the demo
and the benchmark (tasks), their trainer process (worker) and local clusters of
daemons and trainers (cluster, demo)."""
