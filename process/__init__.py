"""What every swarmpipe process shares: log identity (`logs`) and ready files (`ready`)."""
