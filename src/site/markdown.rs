//! Markdown for the site: CommonMark (with tables) to HTML, and text from the data made safe to
//! splice into Markdown. Used by the prose ([`super::prose`]) and the renderer
//! ([`super::render`]) alike, so neither imports the other.

/// CommonMark (with tables) to HTML.
pub fn to_html(md: &str) -> String {
    let parser = pulldown_cmark::Parser::new_ext(md, pulldown_cmark::Options::ENABLE_TABLES);
    let mut html = String::new();
    pulldown_cmark::html::push_html(&mut html, parser);
    html
}

/// CommonMark (with tables) to HTML, every heading given an id from its text (`v3 — two
/// 16-row groups` gets `v3-two-16-row-groups`, repeats numbered), and the headings as
/// (id, text, level), in order.
pub fn to_html_with_ids(md: &str) -> (String, Vec<(String, String, u8)>) {
    use pulldown_cmark::{Event, Tag, TagEnd};
    let options = pulldown_cmark::Options::ENABLE_TABLES;
    // First pass: each heading's text.
    let mut headings: Vec<(String, String, u8)> = Vec::new();
    let mut current: Option<(String, u8)> = None;
    for event in pulldown_cmark::Parser::new_ext(md, options) {
        match event {
            Event::Start(Tag::Heading { level, .. }) => {
                current = Some((String::new(), level as u8))
            }
            Event::Text(t) | Event::Code(t) => {
                if let Some((text, _)) = current.as_mut() {
                    text.push_str(&t);
                }
            }
            Event::End(TagEnd::Heading(_)) => {
                if let Some((text, level)) = current.take() {
                    headings.push((String::new(), text, level));
                }
            }
            _ => {}
        }
    }
    let mut used: Vec<String> = Vec::new();
    for h in &mut headings {
        let base = slug(&h.1);
        let mut id = base.clone();
        let mut n = 1;
        while used.contains(&id) {
            n += 1;
            id = format!("{base}-{n}");
        }
        used.push(id.clone());
        h.0 = id;
    }
    // Second pass: the same events with the ids set.
    let mut next = headings.iter();
    let events = pulldown_cmark::Parser::new_ext(md, options).map(|event| match event {
        Event::Start(Tag::Heading {
            level,
            classes,
            attrs,
            ..
        }) => Event::Start(Tag::Heading {
            level,
            id: next.next().map(|h| h.0.clone().into()),
            classes,
            attrs,
        }),
        other => other,
    });
    let mut html = String::new();
    pulldown_cmark::html::push_html(&mut html, events);
    (html, headings)
}

/// `html` (rendered by [`to_html`]) with every code span whose whole text is one of `links`'
/// names (`<code>kernels/TUNING.md</code>`) made a link to its target, unless it already sits
/// inside a link: prose names a repository file, and the site links the page that publishes it.
pub fn link_code_spans(html: &str, links: &[(String, String)]) -> String {
    let mut out = html.to_string();
    for (name, href) in links {
        let code = format!("<code>{}</code>", super::format::html_escape(name));
        let mut result = String::with_capacity(out.len());
        let mut rest = out.as_str();
        while let Some(at) = rest.find(&code) {
            let (before, after) = rest.split_at(at);
            result.push_str(before);
            if inside_link(&result) {
                result.push_str(&code);
            } else {
                result.push_str(&format!(
                    "<a href=\"{}\">{code}</a>",
                    super::format::html_escape(href)
                ));
            }
            rest = &after[code.len()..];
        }
        result.push_str(rest);
        out = result;
    }
    out
}

/// True when the HTML before a point leaves an `<a …>` open.
fn inside_link(before: &str) -> bool {
    match (before.rfind("<a "), before.rfind("</a>")) {
        (Some(open), Some(close)) => open > close,
        (Some(_), None) => true,
        _ => false,
    }
}

/// Lower-case letters and digits of `text`, runs of anything else as one `-` (`section` when
/// nothing is left): heading anchors, and the Hopper page's per-card anchors and figure names.
pub fn slug(text: &str) -> String {
    let mut out = String::new();
    for c in text.chars() {
        if c.is_alphanumeric() {
            out.extend(c.to_lowercase());
        } else if !out.ends_with('-') && !out.is_empty() {
            out.push('-');
        }
    }
    let out = out.trim_end_matches('-').to_string();
    if out.is_empty() {
        "section".to_string()
    } else {
        out
    }
}

/// Text from data made safe to splice into Markdown: HTML-escaped (pulldown-cmark passes raw
/// HTML through) and with Markdown's punctuation backslash-escaped.
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for ch in s.chars() {
        match ch {
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '&' => out.push_str("&amp;"),
            '"' => out.push_str("&quot;"),
            '\\' | '`' | '*' | '_' | '[' | ']' | '#' | '|' | '!' | '{' | '}' => {
                out.push('\\');
                out.push(ch);
            }
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headings_get_unique_ids() {
        let (html, h) = to_html_with_ids("# Notes\n\n## v1 — `mma.sync`\n\n## v1 — mma.sync\n");
        assert_eq!(h[1].0, "v1-mma-sync");
        assert_eq!(h[2].0, "v1-mma-sync-2");
        assert_eq!(h[1].2, 2);
        assert!(html.contains("<h2 id=\"v1-mma-sync\">"), "{html}");
    }

    #[test]
    fn code_spans_naming_a_file_link_its_page() {
        let links = vec![
            (
                "kernels/TUNING.md".to_string(),
                "/d/tuning.html".to_string(),
            ),
            (
                "kernels/TUNING-moe.md".to_string(),
                "/d/tuning-moe.html".to_string(),
            ),
        ];
        let html = to_html(
            "See `kernels/TUNING.md` and `kernels/TUNING-moe.md`, not `kernels/TUNING.md.bak`, \
             nor [`kernels/TUNING.md`](x.html), nor kernels/TUNING.md.",
        );
        let linked = link_code_spans(&html, &links);
        assert!(
            linked.contains(
                "See <a href=\"/d/tuning.html\"><code>kernels/TUNING.md</code></a> and \
                 <a href=\"/d/tuning-moe.html\"><code>kernels/TUNING-moe.md</code></a>"
            ),
            "{linked}"
        );
        assert!(
            linked.contains("<code>kernels/TUNING.md.bak</code>,"),
            "{linked}"
        );
        assert!(
            linked.contains("<a href=\"x.html\"><code>kernels/TUNING.md</code></a>"),
            "{linked}"
        );
        assert_eq!(linked.matches("tuning.html").count(), 1, "{linked}");
        assert_eq!(link_code_spans(&html, &[]), html);
    }

    #[test]
    fn escaped_text_renders_as_itself() {
        let raw = "a_b *c* <script> [x](y) | `z`";
        let html = to_html(&escape(raw));
        assert_eq!(
            html.trim(),
            "<p>a_b *c* &lt;script&gt; [x](y) | `z`</p>",
            "{html}"
        );
    }
}
