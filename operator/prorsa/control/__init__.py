"""The controller: lifecycle events in, role switches out, over a `Cluster` port."""
