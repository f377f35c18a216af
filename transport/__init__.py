"""Transport plumbing shared by nodes, the coordinator and the testnet: gRPC servers and
channels (`rpc`) and the unit and range of send limits (`limits`)."""
