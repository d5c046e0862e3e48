"""pdserve cluster launchers: local processes (``cluster.local``) and Ray actors (``cluster.ray_*``)."""
