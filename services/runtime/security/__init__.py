"""Who a peer is and what it may do: mutual TLS for servers, channels and etcd clients (tls), the
mesh's CA and per-identity certificates (certificates) that rotate without a restart
(certificate_reload), identities read from a verified certificate (identity), the table of who
may call which method (authorization), the instance a call acts for (acting_instance), and files
only their owner may read (private_files)."""
