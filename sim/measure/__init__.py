"""What `pdserve sim calibrate` measures on this machine: the engine's steps (calibrate.py), two engines
sharing its cores (sharing.py), a KV push between two processes (wire.py), and the running cluster
(real.py starts it and drives loads; calibrate_cluster.py fits the costs to its traced steps).

Not pure, unlike the simulator above it: these modules start the engine, gRPC servers and Ray, and
stand on the roles and deploy/ as the application does. The simulator itself only reads the costs
they write.
"""
