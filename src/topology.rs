//! Topology.
