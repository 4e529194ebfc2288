"""What both services share: settings, metrics, auth, gRPC server set-up and the weight stream."""
