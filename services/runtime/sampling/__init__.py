"""What a generation request asks for, read the same by the gateway and the workers: the sampling
parameters as plain values (sampling_params) and from the wire (sampling_proto), the one set of
checks on a request (request_validation), and stop strings found in a bounded tail of the output
(stop_window). Torch-free and gRPC-free."""
