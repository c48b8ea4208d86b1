//! A command's output on stdout. `print!` panics when the write fails; these return the
//! error instead, so that a reader closing the pipe early (`delay-bridge ladders | head`)
//! ends the command quietly ([`is_closed_pipe`]) as it ends `cat`, and any other write
//! error is reported as an error.

use std::fmt::Arguments;
use std::io::Write;

/// Writes `args` to stdout and flushes it.
pub fn write(args: Arguments<'_>) -> std::io::Result<()> {
    let mut stdout = std::io::stdout().lock();
    stdout.write_fmt(args)?;
    stdout.flush()
}

/// True when `error` comes from writing to a pipe its reader closed.
pub fn is_closed_pipe(error: &anyhow::Error) -> bool {
    error.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
    })
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
