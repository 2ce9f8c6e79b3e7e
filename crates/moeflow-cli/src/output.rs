//! Writing to stdout and stderr without panicking. `println!`, `print!`, `eprintln!` and
//! `eprint!` are redefined here for the whole CLI (declared before every other module), so
//! each write goes through [`write_or_exit`]: a closed pipe (`moeflow inspect … | head -2`)
//! ends the program quietly with success, as coreutils do; any other write error (a full disk)
//! ends it with an error naming the stream.

use std::io::Write;

/// Prints to stdout; see the module documentation for write errors.
macro_rules! print {
    ($($arg:tt)*) => { $crate::output::write_or_exit($crate::output::Stream::Stdout, format_args!($($arg)*)) };
}

/// Prints a line to stdout; see the module documentation for write errors.
macro_rules! println {
    () => { print!("\n") };
    ($($arg:tt)*) => { print!("{}\n", format_args!($($arg)*)) };
}

/// Prints to stderr; see the module documentation for write errors.
macro_rules! eprint {
    ($($arg:tt)*) => { $crate::output::write_or_exit($crate::output::Stream::Stderr, format_args!($($arg)*)) };
}

/// Prints a line to stderr; see the module documentation for write errors.
macro_rules! eprintln {
    () => { eprint!("\n") };
    ($($arg:tt)*) => { eprint!("{}\n", format_args!($($arg)*)) };
}

/// A standard stream.
#[derive(Clone, Copy, Debug)]
pub enum Stream {
    /// Standard output.
    Stdout,
    /// Standard error.
    Stderr,
}

/// Writes `args` to `stream` (and flushes it); on failure ends the process as
/// [`exit_on_write_error`] does.
pub fn write_or_exit(stream: Stream, args: std::fmt::Arguments) {
    let result = match stream {
        Stream::Stdout => {
            let mut out = std::io::stdout().lock();
            out.write_fmt(args).and_then(|()| out.flush())
        }
        Stream::Stderr => std::io::stderr().lock().write_fmt(args),
    };
    if let Err(e) = result {
        exit_on_write_error(stream, &e);
    }
}

/// Flushes stdout before the program ends, so a late write error is reported too.
pub fn flush_stdout() {
    if let Err(e) = std::io::stdout().lock().flush() {
        exit_on_write_error(Stream::Stdout, &e);
    }
}

/// Ends the process after a failed write: exit status 0 when the reader closed the pipe
/// (nothing is left to say to anyone), otherwise 1 with the error on stderr when stderr works.
fn exit_on_write_error(stream: Stream, e: &std::io::Error) -> ! {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(0);
    }
    let name = match stream {
        Stream::Stdout => "stdout",
        Stream::Stderr => "stderr",
    };
    let _ = writeln!(std::io::stderr(), "error: writing to {name}: {e}");
    std::process::exit(1);
}

/// Reports `e` on stderr (ignoring a failure to) and ends the process with status 1.
pub fn exit_with_error(e: &dyn std::fmt::Display) -> ! {
    let _ = writeln!(std::io::stderr(), "error: {e}");
    std::process::exit(1);
}
