//! AMQP plumbing.
