//! A command's output on stdout. `print!` panics when the write fails; these return the
//! error instead: a reader closing the pipe early (`delay-bridge ladders | head`) becomes
//! [`StdoutClosed`], which ends the command quietly ([`is_closed_pipe`]) as it ends `cat`,
//! and any other write error is reported as an error. A broken pipe anywhere else (a socket
//! the broker closed) stays a failure.

use std::fmt::Arguments;
use std::io::Write;

/// Stdout's reader closed the pipe: the command has nobody left to tell.
#[derive(Debug, thiserror::Error)]
#[error("stdout was closed: {0}")]
pub struct StdoutClosed(std::io::Error);

/// Writes `args` to stdout and flushes it; a closed pipe is [`StdoutClosed`].
pub fn write(args: Arguments<'_>) -> anyhow::Result<()> {
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_fmt(args)
        .and_then(|()| stdout.flush())
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::BrokenPipe => anyhow::Error::from(StdoutClosed(e)),
            _ => anyhow::Error::from(e).context("writing to stdout"),
        })
}

/// True when `error` is stdout's reader closing the pipe ([`StdoutClosed`]), and nothing
/// else.
pub fn is_closed_pipe(error: &anyhow::Error) -> bool {
    error.downcast_ref::<StdoutClosed>().is_some()
}

/// `print!` that returns the write's error.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::output::write(format_args!($($arg)*))
    };
}

/// `println!` that returns the write's error.
macro_rules! outln {
    () => {
        $crate::output::write(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::output::write(format_args!("{}\n", format_args!($($arg)*)))
    };
}

pub(crate) use {out, outln};

#[cfg(test)]
mod tests {
    use super::*;

    /// A broken pipe anywhere else (a socket the broker closed, under a declare or a
    /// health check) is a failure: only stdout's own reader closing ends a command quietly.
    #[test]
    fn only_stdouts_own_closed_pipe_ends_a_command_quietly() {
        let socket = std::io::Error::from(std::io::ErrorKind::BrokenPipe);
        let declare = anyhow::Error::from(socket).context("declaring the topology");
        assert!(!is_closed_pipe(&declare));
        let closed = anyhow::Error::from(StdoutClosed(std::io::Error::from(
            std::io::ErrorKind::BrokenPipe,
        )))
        .context("printing the plan");
        assert!(is_closed_pipe(&closed));
    }
}
