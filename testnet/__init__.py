"""testnet"""

import os

# Only gRPC's errors on the testnet's stderr. Unset, gRPC's C core also prints INFO lines
# there, such as "Other threads are currently calling into gRPC, skipping fork() handlers"
# when a churn start forks during a Status call: written straight to fd 2, it tore a
# frozen copy of the live progress bar into the terminal. grpc reads the variable when it
# is imported, which is after this package (testnet/main.py imports it).
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
