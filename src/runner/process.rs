//! Child processes: one per (case, implementation) with a time limit, and the long-lived
//! comparison server that forks one fresh process per case. A child whose parent dies stops
//! too ([`exit_with_parent`]), so a killed runner leaves nothing holding the GPU.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::protocol::{Job, Reply};

/// Waits for `child`, polling every `poll`; kills it once `limit` has passed since `t0`.
/// Returns its exit status, or `None` when it was killed.
///
/// # Errors
/// Errors of `try_wait`.
pub fn wait_with_limit(
    child: &mut Child,
    t0: Instant,
    limit: Duration,
    poll: Duration,
) -> std::io::Result<Option<ExitStatus>> {
    loop {
        if let Some(st) = child.try_wait()? {
            return Ok(Some(st));
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return Ok(None);
        }
        std::thread::sleep(poll);
    }
}

/// Starts a thread that ends this process (exit code 3) as soon as its parent is gone: the
/// parent id changes when the parent dies and the process is re-parented.
pub fn exit_with_parent() {
    let parent = std::os::unix::process::parent_id();
    std::thread::spawn(move || loop {
        if std::os::unix::process::parent_id() != parent {
            eprintln!("parent process {parent} is gone; exiting");
            std::process::exit(3);
        }
        std::thread::sleep(Duration::from_millis(200));
    });
}

/// How a child run ended.
#[derive(Debug)]
pub enum ChildEnd {
    /// It exited; its status, standard output and standard error.
    Exited {
        /// Exit status.
        status: ExitStatus,
        /// Standard output.
        stdout: String,
        /// Standard error.
        stderr: String,
    },
    /// It ran past its limit and was killed.
    Killed {
        /// Seconds it ran.
        after_s: f64,
    },
}

/// Runs `cmd` to completion under `limit`, capturing its output.
///
/// # Errors
/// When the process cannot be started or waited for.
pub fn run_with_limit(mut cmd: Command, limit: Duration) -> std::io::Result<ChildEnd> {
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()?;
    let t0 = Instant::now();
    let mut stdout = child.stdout.take().expect("piped");
    let mut stderr = child.stderr.take().expect("piped");
    let out_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let status = wait_with_limit(&mut child, t0, limit, Duration::from_millis(20))?;
    let Some(status) = status else {
        // Killed: its own children may still hold the pipes open, so the readers are left
        // to finish on their own.
        return Ok(ChildEnd::Killed {
            after_s: t0.elapsed().as_secs_f64(),
        });
    };
    let stdout = out_reader.join().unwrap_or_default();
    let stderr = err_reader.join().unwrap_or_default();
    Ok(ChildEnd::Exited {
        status,
        stdout,
        stderr,
    })
}

/// The last `n` characters of `s`, trimmed.
pub fn tail(s: &str, n: usize) -> String {
    let chars: Vec<char> = s.chars().collect();
    let start = chars.len().saturating_sub(n);
    chars[start..].iter().collect::<String>().trim().to_string()
}

/// The last line of `stdout` that parses as a [`Reply`].
pub fn last_reply(stdout: &str) -> Option<Result<Reply, serde_json::Error>> {
    stdout
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .map(serde_json::from_str)
}

/// A comparison module running as a server: `python3 -m compare.<module> serve`, reading one
/// [`Job`] per line on its standard input and answering one [`Reply`] per line; it measures
/// each job in a fresh process forked from itself (torch imported, CUDA never initialised in
/// the server), under the job's time limit.
pub struct Server {
    child: Child,
    stdin: std::process::ChildStdin,
    replies: mpsc::Receiver<String>,
}

impl Server {
    /// Starts `python -m compare.<module> serve` with `runners_dir` on `PYTHONPATH` and `envs`
    /// added to the environment; its standard error goes to ours.
    ///
    /// # Errors
    /// When the interpreter cannot be started.
    pub fn start(
        python: &str,
        runners_dir: &Path,
        module: &str,
        envs: &[(String, String)],
    ) -> std::io::Result<Server> {
        let mut path = runners_dir.as_os_str().to_owned();
        if let Some(old) = std::env::var_os("PYTHONPATH") {
            path.push(":");
            path.push(old);
        }
        let mut child = Command::new(python)
            .args(["-m", &format!("compare.{module}"), "serve"])
            .env("PYTHONPATH", path)
            .env("PYTHONUNBUFFERED", "1")
            // Cold first calls, as for the project's case processes: without this, a library
            // that compiles kernels at run time (cuDNN) finds them in the driver's cache after
            // the first process, and `first_call_s` depends on the order the cases ran in.
            .env("CUDA_CACHE_DISABLE", "1")
            .envs(envs.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        let stdin = child.stdin.take().expect("piped");
        let stdout = child.stdout.take().expect("piped");
        let (tx, replies) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if line.trim_start().starts_with('{') && tx.send(line).is_err() {
                    break;
                }
            }
        });
        Ok(Server {
            child,
            stdin,
            replies,
        })
    }

    /// Sends `job` and waits up to `limit` for the reply line.
    ///
    /// # Errors
    /// A message saying what went wrong: the server exited, timed out (it is then killed and
    /// must be restarted) or answered something that is not a reply.
    pub fn request(&mut self, job: &Job, limit: Duration) -> Result<Reply, String> {
        let line = serde_json::to_string(job).map_err(|e| format!("job JSON: {e}"))?;
        if let Err(e) = writeln!(self.stdin, "{line}").and_then(|_| self.stdin.flush()) {
            return Err(format!("the comparison process is not listening: {e}"));
        }
        match self.replies.recv_timeout(limit) {
            Ok(text) => serde_json::from_str(&text)
                .map_err(|e| format!("the comparison process sent a bad reply: {e}")),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                self.kill();
                Err(format!(
                    "the comparison process did not answer within {:.0} s and was killed",
                    limit.as_secs_f64()
                ))
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let status = self.child.wait().map(|s| s.to_string()).unwrap_or_default();
                Err(format!("the comparison process ended ({status})"))
            }
        }
    }

    /// True while the server process runs.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Kills the server.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // Closing stdin ends the server's loop; give it a moment, then make sure.
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(2) {
            if !self.alive() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_past_its_limit_is_killed() {
        let t0 = Instant::now();
        let mut slow = Command::new("sleep").arg("5").spawn().unwrap();
        let waited = wait_with_limit(
            &mut slow,
            t0,
            Duration::from_millis(100),
            Duration::from_millis(10),
        );
        assert!(matches!(waited, Ok(None)), "{waited:?}");
        assert!(t0.elapsed() < Duration::from_secs(4));
        let mut quick = Command::new("true").spawn().unwrap();
        let waited = wait_with_limit(
            &mut quick,
            Instant::now(),
            Duration::from_secs(5),
            Duration::from_millis(10),
        );
        assert!(waited.unwrap().unwrap().success());
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo out; echo err >&2; sleep 5"]);
        match run_with_limit(cmd, Duration::from_millis(200)).unwrap() {
            ChildEnd::Killed { after_s, .. } => assert!(after_s < 4.0),
            other => panic!("{other:?}"),
        }
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo '{\"x\": 1}'; echo last"]);
        match run_with_limit(cmd, Duration::from_secs(5)).unwrap() {
            ChildEnd::Exited { status, stdout, .. } => {
                assert!(status.success());
                assert!(stdout.contains("last"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn tail_keeps_the_end() {
        assert_eq!(tail("  abcdef  ", 4), "ef");
        assert_eq!(tail("ab", 10), "ab");
    }
}
