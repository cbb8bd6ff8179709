//! How this `provledger` was invoked, so that every command it suggests can be pasted as
//! printed: the one place that builds the global flags a suggestion carries (`--nats URL`,
//! `--data-dir DIR`, and `--stream`, `--subject-prefix`, `--stream-replicas`, `--creds`,
//! `--nkey`, `--tls-*` when given), and the message for a data dir another process holds.

use std::path::Path;
use std::sync::OnceLock;

use provledger_client::LedgerOptions;

/// The data dir, stream, prefix and replicas a command uses when none is given.
pub const DATA_DIR_DEFAULT: &str = "./provledger-data";
pub const STREAM_DEFAULT: &str = "PROVLEDGER";
pub const SUBJECT_PREFIX_DEFAULT: &str = "provledger";

/// What a suggestion to ask a running service puts for its NATS URL: the variable the
/// quick start and the deployment set (README, deploy/).
pub const NATS_URL_PLACEHOLDER: &str = "$PROVLEDGER_NATS_URL";

/// The global flags a suggested command repeats, and the command that was run.
#[derive(Clone, Debug, Default)]
pub struct Invocation {
    /// `--nats URL` (password shown as `***`), when given.
    nats: Option<String>,
    /// `--data-dir DIR`, when not the default.
    data_dir: Option<String>,
    /// Every other flag that says where the ledger is, as rendered tokens.
    others: Vec<String>,
    /// The command as run, without its global flags (`audit`, `state cluster/ID`).
    command: String,
    /// The global flags that take a value (`nats`, `data-dir`, ...), to tell a flag's
    /// value from a subcommand when reading a command line.
    valued_globals: Vec<String>,
    /// The subcommands' names: which `provledger WORD` in a message is a command.
    subcommands: Vec<String>,
}

static CURRENT: OnceLock<Invocation> = OnceLock::new();

/// Sets this process's invocation, once, before any command runs.
pub fn set(invocation: Invocation) {
    let _ = CURRENT.set(invocation);
}

/// This process's invocation (none when unset, as in unit tests: suggestions then carry
/// no flag).
pub fn current() -> &'static Invocation {
    CURRENT.get_or_init(Invocation::default)
}

impl Invocation {
    /// From the ledger options in effect, this process's arguments (`args`, without the
    /// program name), the global flags that take a value and the subcommands' names.
    pub fn new(
        options: &LedgerOptions,
        args: &[String],
        valued_globals: Vec<String>,
        subcommands: Vec<String>,
    ) -> Invocation {
        let mut others = Vec::new();
        let mut flag = |name: &str, value: &str| {
            others.push(format!("--{name} {}", shell_word(value)));
        };
        if options.stream != STREAM_DEFAULT {
            flag("stream", &options.stream);
        }
        if options.subject_prefix != SUBJECT_PREFIX_DEFAULT {
            flag("subject-prefix", &options.subject_prefix);
        }
        if options.stream_replicas != 1 {
            flag("stream-replicas", &options.stream_replicas.to_string());
        }
        let auth = &options.nats_auth;
        for (name, path) in [
            ("creds", &auth.creds),
            ("nkey", &auth.nkey),
            ("tls-ca", &auth.tls_ca),
            ("tls-cert", &auth.tls_cert),
            ("tls-key", &auth.tls_key),
        ] {
            if let Some(path) = path {
                flag(name, &path.to_string_lossy());
            }
        }
        let data_dir = (options.data_dir != Path::new(DATA_DIR_DEFAULT)).then(|| {
            format!(
                "--data-dir {}",
                shell_word(&options.data_dir.to_string_lossy())
            )
        });
        let mut invocation = Invocation {
            nats: options.nats_url.as_deref().map(|url| {
                format!(
                    "--nats {}",
                    shell_word(&provledger_client::redacted_nats_url(url))
                )
            }),
            data_dir,
            others,
            command: String::new(),
            valued_globals,
            subcommands,
        };
        invocation.command = invocation
            .without_globals(args)
            .iter()
            .map(|a| shell_word(a))
            .collect::<Vec<_>>()
            .join(" ");
        invocation
    }

    /// `provledger`, the global flags, then `rest`: a command to paste as printed.
    pub fn command(&self, rest: &str) -> String {
        let mut words = vec!["provledger".to_string()];
        words.extend(self.nats.iter().cloned());
        words.extend(self.data_dir.iter().cloned());
        words.extend(self.others.iter().cloned());
        words.push(rest.to_string());
        words.join(" ")
    }

    /// The same ledger asked over NATS: `--nats $PROVLEDGER_NATS_URL` (a running
    /// service's URL, which this process cannot know) instead of `--data-dir`.
    pub fn over_nats(&self) -> Invocation {
        Invocation {
            nats: Some(format!("--nats {NATS_URL_PLACEHOLDER}")),
            data_dir: None,
            ..self.clone()
        }
    }

    /// The command that was run, without its global flags (`operation list`).
    pub fn this_command(&self) -> &str {
        &self.command
    }

    /// `text` with the global flags put into every command it suggests (`provledger
    /// rollback run OP` becomes `provledger --nats URL rollback run OP`). `provledger
    /// serve` names the service rather than a command to paste, and stays as it is.
    pub fn in_text(&self, text: &str) -> String {
        let flags = self.command("");
        let flags = flags.trim_end();
        if flags == "provledger" {
            return text.to_string();
        }
        let mut out = String::with_capacity(text.len() + flags.len());
        let mut rest = text;
        while let Some(at) = rest.find("provledger ") {
            let after = &rest[at + "provledger ".len()..];
            let word: String = after
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect();
            let starts_a_word = rest[..at]
                .chars()
                .next_back()
                .is_none_or(|c| !c.is_ascii_alphanumeric() && c != '-' && c != '_');
            out.push_str(&rest[..at]);
            if starts_a_word && word != "serve" && self.subcommands.contains(&word) {
                out.push_str(flags);
                out.push(' ');
            } else {
                out.push_str("provledger ");
            }
            rest = after;
        }
        out.push_str(rest);
        out
    }

    /// `args` without the global flags and their values: the subcommand and its own.
    fn without_globals(&self, args: &[String]) -> Vec<String> {
        let mut kept = Vec::new();
        let mut args = args.iter();
        while let Some(arg) = args.next() {
            let Some(flag) = arg.strip_prefix("--") else {
                kept.push(arg.clone());
                continue;
            };
            if flag.is_empty() {
                kept.push(arg.clone());
                kept.extend(args.cloned());
                break;
            }
            let (name, inline_value) = match flag.split_once('=') {
                Some((name, _)) => (name, true),
                None => (flag, false),
            };
            if self.valued_globals.iter().any(|g| g == name) {
                if !inline_value {
                    args.next();
                }
            } else if name != "json" {
                kept.push(arg.clone());
            }
        }
        kept
    }

    /// The subcommand of a provledger command line (`argv`, the program name first), if
    /// it is one: how a lock's holder is told to be `provledger serve`.
    pub fn subcommand_of(&self, argv: &[String]) -> Option<String> {
        let program = argv.first()?;
        let named = Path::new(program)
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("provledger"));
        if !named {
            return None;
        }
        self.without_globals(&argv[1..])
            .into_iter()
            .find(|a| !a.starts_with('-'))
            .filter(|a| self.subcommands.contains(a))
    }

    /// The message for a data dir another process holds (`holder` as the lock file
    /// records it: `pid N`): who holds it, serve if its command line says so, and the
    /// command that asks the running service instead. Never "stop it": the holder may be
    /// the production service.
    pub fn locked_message(&self, dir: &Path, holder: &str) -> String {
        let dir = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
        let pid = holder
            .strip_prefix("pid ")
            .and_then(|p| p.trim().parse::<u32>().ok());
        let is_serve = pid
            .and_then(command_line_of)
            .is_some_and(|argv| self.subcommand_of(&argv).as_deref() == Some("serve"));
        let this = self.this_command();
        let this_is_serve = this == "serve" || this.starts_with("serve ");
        let held_by = if is_serve {
            format!("`provledger serve` ({holder})")
        } else {
            format!("another provledger process ({holder})")
        };
        let start = format!(
            "data dir {} is locked by {held_by}: a data dir is opened by one process at a time",
            dir.display()
        );
        if this_is_serve {
            return format!(
                "{start}; each serve replica needs a data dir of its own: start this one \
                 with another --data-dir"
            );
        }
        let ask = self.over_nats().command(if this.is_empty() {
            "query health"
        } else {
            this
        });
        if is_serve {
            format!(
                "{start}. Ask that service instead, over the NATS it serves \
                 ({NATS_URL_PLACEHOLDER}: the URL it was started with): `{ask}` (`query \
                 ENDPOINT` asks it anything); it keeps running"
            )
        } else {
            format!(
                "{start}. If it is `provledger serve`, ask that service instead, over the NATS \
                 it serves ({NATS_URL_PLACEHOLDER}: the URL it was started with): `{ask}`; if it \
                 is a command that ends (audit, state, ...), run this again once it has"
            )
        }
    }
}

/// A process's command line, where the system tells it (`/proc/PID/cmdline`).
fn command_line_of(pid: u32) -> Option<Vec<String>> {
    let raw = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let argv: Vec<String> = raw
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    (!argv.is_empty()).then_some(argv)
}

/// `word` as one shell word: as it is when it needs no quoting, else in single quotes.
fn shell_word(word: &str) -> String {
    let plain = !word.is_empty()
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-./:@,=+%".contains(c));
    if plain {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn invocation(nats: Option<&str>, data_dir: &str, stream: &str, args: &[&str]) -> Invocation {
        let options = LedgerOptions {
            nats_url: nats.map(str::to_string),
            data_dir: data_dir.into(),
            stream: stream.into(),
            subject_prefix: SUBJECT_PREFIX_DEFAULT.into(),
            stream_replicas: 1,
            nats_auth: Default::default(),
        };
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        let valued = ["nats", "data-dir", "stream", "subject-prefix", "log-format"];
        Invocation::new(
            &options,
            &args,
            valued.iter().map(|s| s.to_string()).collect(),
            ["audit", "rollback", "serve", "state", "operation"]
                .iter()
                .map(|s| s.to_string())
                .collect(),
        )
    }

    #[test]
    fn a_suggestion_carries_the_flags_that_reach_the_same_ledger() {
        // Given a command run over NATS on a stream of its own...
        let i = invocation(
            Some("nats://u:secret@h:4222"),
            DATA_DIR_DEFAULT,
            "OTHER",
            &[
                "--json",
                "--nats",
                "nats://u:secret@h:4222",
                "audit",
                "--stream=OTHER",
            ],
        );
        // ...then what it suggests names the URL (password hidden) and the stream...
        assert_eq!(
            i.in_text("then `provledger rollback run X`; `provledger serve` drives it"),
            "then `provledger --nats 'nats://u:***@h:4222' --stream OTHER rollback run X`; \
             `provledger serve` drives it"
        );
        // ...and the command it ran is told without its global flags.
        assert_eq!(i.this_command(), "audit");
    }

    #[test]
    fn an_embedded_suggestion_carries_its_data_dir_and_leaves_other_words_alone() {
        let i = invocation(None, "/srv/my dir", STREAM_DEFAULT, &["state", "cluster/x"]);
        assert_eq!(
            i.in_text("provledger applies it; run provledger audit"),
            "provledger applies it; run provledger --data-dir '/srv/my dir' audit"
        );
        assert_eq!(
            i.over_nats().command(i.this_command()),
            "provledger --nats $PROVLEDGER_NATS_URL state cluster/x"
        );
    }

    #[test]
    fn the_subcommand_of_a_command_line_skips_global_flags_and_their_values() {
        let i = invocation(None, DATA_DIR_DEFAULT, STREAM_DEFAULT, &["audit"]);
        let argv = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            i.subcommand_of(&argv(&[
                "/usr/bin/provledger",
                "--data-dir",
                "serve",
                "--nats=x",
                "serve"
            ])),
            Some("serve".into())
        );
        assert_eq!(i.subcommand_of(&argv(&["/usr/bin/other", "serve"])), None);
    }
}
