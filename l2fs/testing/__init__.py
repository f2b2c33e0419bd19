"""Dev and test tooling, not run by a deployment: `cluster` (LocalCluster: master(s) + workers on loopback,
`l2fs local`) and `netns` (nodes in network namespaces, `l2fs netns`)."""
