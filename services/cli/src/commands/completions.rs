//! `provledger completions SHELL` and `provledger man`: the shell completion scripts and
//! the man pages, generated from the clap command line itself, so they never disagree with
//! `--help`. Both only print (or write into the directory given); neither opens a ledger.

use std::io::Write;
use std::path::Path;

use super::CommandError;

/// Prints the completion script of `shell` for `command` on stdout.
pub fn completions(
    shell: clap_complete::Shell,
    mut command: clap::Command,
) -> Result<(), CommandError> {
    let name = command.get_name().to_string();
    let mut out = Vec::new();
    clap_complete::generate(shell, &mut command, name, &mut out);
    write_stdout(&out)
}

/// Prints the man page of `command` on stdout, or, with `out_dir`, writes one page per
/// command and subcommand there (`provledger.1`, `provledger-serve.1`, ...).
pub fn man(command: clap::Command, out_dir: Option<&Path>) -> Result<(), CommandError> {
    match out_dir {
        Some(dir) => clap_mangen::generate_to(command, dir).map_err(|e| {
            CommandError::Infrastructure(format!(
                "cannot write the man pages into {}: {e}; give a writable --out-dir",
                dir.display()
            ))
        }),
        None => {
            let mut out = Vec::new();
            clap_mangen::Man::new(command)
                .render(&mut out)
                .map_err(|e| {
                    CommandError::Infrastructure(format!("rendering the man page: {e}"))
                })?;
            write_stdout(&out)
        }
    }
}

fn write_stdout(bytes: &[u8]) -> Result<(), CommandError> {
    let mut stdout = std::io::stdout().lock();
    stdout
        .write_all(bytes)
        .and_then(|()| stdout.flush())
        .map_err(|e| CommandError::Infrastructure(format!("writing to stdout: {e}")))
}
