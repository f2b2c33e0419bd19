"""Local l2fs cluster on loopback: a master and N workers as real processes (each worker its own node).

CONTRACT STUB (see client.py). Used by `l2fs local`, tests and `kvtier up`:

    with LocalCluster(base_dir, workers=2) as cluster:
        cluster.master                  # "127.0.0.1:PORT"
        cluster.workers[i].node_id      # "node-1", "node-2", ...
        cluster.workers[i].data_dir     # pathlib.Path
        cluster.kill_worker(i, signal.SIGKILL); cluster.start_worker(i)
        cluster.kill_master(); cluster.start_master()
        cluster.client(node_id="node-1")  # an l2fs.Client
"""
